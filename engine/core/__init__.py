"""The engine's core state and policy: requests and what they ask for
(``request``, ``sampling_params``, ``guided_spec``, ``request_limits``), the paged KV
blocks (``block_pool``, ``kv_cache_manager``), the ``scheduler``, what the engine hands
back (``outputs``) and the incremental ``detokenizer``."""
