"""A worker whose engine is vLLM: a vLLM server process behind a thin FleetShift shim
(docs/vllm.md says why this shape, and what each WorkerService call does here)."""
