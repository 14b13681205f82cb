"""SLO autoscaler for the prefill and decode Deployments (``python -m autoscaler``).

``signals`` turns router metrics into windowed TTFT/ITL p90 and queue depth, ``policy``
decides (pure), ``kube`` patches the Deployments' scale subresource, ``controller`` runs
the loop, ``metrics`` exposes the autoscaler's own Prometheus metrics.
"""
