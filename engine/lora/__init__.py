"""Multi-LoRA serving: adapters (adapter.py), device slots and the batched LoRA term
(slots.py, triton_lora.py), slot policy (manager.py), the request type (request.py). The
engine's glue is the top-level engine/lora_serving.py. docs/lora.md describes the feature,
docs/design.md §3 "LoRA" its contracts."""
