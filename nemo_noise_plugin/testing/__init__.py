"""Support for running real Megatron-Core on a machine without a GPU (tests and the CPU main job).

``cpu_substitutes`` is the only place where CUDA-only pieces are replaced; ``harness`` builds tiny models on gloo
process groups. Nothing else in the package imports this subpackage.
"""
