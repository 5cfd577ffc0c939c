"""Running the real Megatron-Core on a machine without a GPU: the CPU substitutes and gloo process groups.

Used by the CPU main job (which lists the substitutes when it starts) and by the tests. ``substitutes`` is the only
place where CUDA-only pieces are replaced, and only by an explicit ``install_cpu_substitutes()`` (or
``init_cpu_parallel``, which calls it); importing this package changes nothing.
"""

from nemo_noise_plugin.jobs.cpu.parallel import (
    causal_attention_mask,
    destroy_cpu_parallel,
    free_port,
    init_cpu_parallel,
)
from nemo_noise_plugin.jobs.cpu.substitutes import (
    CPU_SUBSTITUTES,
    install_cpu_substitutes,
)

__all__ = [
    "CPU_SUBSTITUTES",
    "causal_attention_mask",
    "destroy_cpu_parallel",
    "free_port",
    "init_cpu_parallel",
    "install_cpu_substitutes",
]
