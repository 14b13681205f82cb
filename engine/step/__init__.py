"""The engine's step (docs/design.md §3 "The step"): how a step is launched and finished
(synchronously, with asynchronous scheduling, or with pipeline batches in flight), the
per-step hooks around it, and the post-processing of a step's logits into outputs."""
