"""``benchmarks/noise_in_lookup.py``'s static PTX counts (the kernel benchmark itself needs a GPU: tests/gpu)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.noise_in_lookup import code_counts

PTX = """
.visible .entry add_noise_kernel(
	.param .u64 add_noise_kernel_param_0
)
{
	.reg .pred 	%p<3>;
	ld.param.u64 	%rd1, [add_noise_kernel_param_0];
	mul.wide.u32 	%rd2, %r1, -766435501;
	xor.b32 	%r3, %r2, %r1;
	@%p1 ld.global.v4.b32 { %r4, %r5, %r6, %r7 }, [ %rd1 + 0 ];
	@!%p2 st.global.b16 [ %rd2 + 0 ], { %rs1 };
$L__BB0_2:
	lg2.approx.f32 %f2, %f1;
	sin.approx.f32 %f3, %f2;
	ret;
}
"""


def test_code_counts_reads_opcodes_and_skips_directives_labels_and_braces():
    counts = code_counts(SimpleNamespace(asm={"ptx": PTX}))
    assert counts["ptx"] == {"ld": 2, "mul": 1, "xor": 1, "st": 1, "lg2": 1, "sin": 1, "ret": 1}
    assert counts["ptx_total"] == 8
