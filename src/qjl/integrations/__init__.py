"""Framework integrations: :mod:`qjl.integrations.transformers` (a ``Cache`` and an attention function);
each is imported only when used."""
