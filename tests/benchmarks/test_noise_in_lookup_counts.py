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


def test_against_an_earlier_kernel_file_compares_fast_math_only_where_that_file_has_it(tmp_path):
    from pathlib import Path

    from benchmarks.noise_in_lookup import earlier_variants, load_kernel_file, variant_name

    this = load_kernel_file(Path(__file__).resolve().parents[2] / "nemo_noise_plugin" / "noise" / "triton_kernel.py")
    names = [variant_name(*variant) for variant in earlier_variants(this)]
    assert names == ["uniform", "gaussian", "laplace", "gaussian_fast_math", "laplace_fast_math"]
    older = tmp_path / "older_triton_kernel.py"  # e24a060's launcher took no fast_math
    older.write_text(
        "def launch_add_noise(x, out, *, input_ids=None, seed, iteration, distribution='uniform'):\n    pass\n"
    )
    assert [variant_name(*variant) for variant in earlier_variants(load_kernel_file(older))] == [
        "uniform",
        "gaussian",
        "laplace",
    ]
