"""Where the plugin meets upstream code: the one importer of Megatron-Bridge, and the copies of Megatron-Core.

``bridge_imports`` imports Megatron-Bridge on machines without Transformer Engine (``import_bridge``); ``copies``
lists the pieces of Megatron-Core the plugin copies and changes, with the digest a test checks them against.
"""
