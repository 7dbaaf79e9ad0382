"""The inference engine: models on a paged KV cache with continuous batching (no network here).

Import from the modules themselves: `engine.LLMEngine`, `config.EngineConfig`, `sampling_params.SamplingParams`,
`outputs.RequestOutput`, `kv_handoff.KVImport` / `KVExportSink`, and the error types in `errors`. This package
imports nothing, so `qwenserve.engine.sampling_params` stays cheap to import without torch.
"""
