"""Reference engine in torch: Llama-family model over a paged KV cache (synchronous core).

Modules: config (frozen configs, HF config.json), checkpoint (HF-layout safetensors load/generate),
tokenizer, kv_cache (pools, block manager), attention (paged attention), model (layers, PP/TP
slices), sampling, scheduler (continuous batching, chunked prefill), engine (the step loop).
"""
