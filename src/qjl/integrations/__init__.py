"""Framework integrations: :mod:`qjl.integrations.transformers` (a ``Cache`` and an attention function)
and :mod:`qjl.integrations.vllm` (an attention backend, a vLLM plugin); each is imported only when used."""
