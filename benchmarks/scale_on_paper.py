"""The noise layer's and a teacher's share of a training step for Llama-3.1-8B and a 70B model, on paper (issue 34).

From model FLOPs and the noise kernel measured on an H200 (``benchmarks/RESULTS.md``, "Noise kernel"): per replica
(TP x PP GPUs) a step of ``m`` micro-batches of ``mb`` x ``s`` tokens costs, on the first pipeline stage (which runs
the embedding and the noise, and is on the critical path of 1F1B),

    t_mb    = 6 * N * mb * s / (TP * PP * F)          one micro-batch's forward + backward on one stage
    t_step  = (m + PP - 1) * t_mb                      with the pipeline bubble
    t_noise = m * 4 * s * mb * h / (TP if SP else 1) / B   bf16 read + write of the embedding output per micro-batch
    teacher = 2 * N_t * tokens / (6 * N * tokens + 2 * N_t * tokens)   a frozen teacher's forward in the same layout

``F`` is the achieved bf16 FLOP/s per GPU (``--mfu`` x 989 TFLOP/s, the H200's dense bf16 peak), ``B`` the kernel's
measured effective bandwidth at that hidden size (read + write bytes / time). 6N ignores attention's 12 * L * h * s
FLOPs per token, so the shares below are upper bounds. Prints the markdown section of ``SFT_THROUGHPUT.md``.

    python benchmarks/scale_on_paper.py [--mfu 0.4]
"""

from __future__ import annotations

import argparse

H200_BF16_FLOPS = 989e12
# Effective TB/s of the fused kernel (bytes read + written / time) in RESULTS.md's H200 run, by hidden size:
# [4096,2,2048] 67.1 MB in 21.1 us (uniform) / 36.1 us (Gaussian); [4096,2,4096] 134.2 MB in 40.4 / 69.7 us;
# [8192,1,8192] 268.4 MB in 70.2 / 118.5 us.
MEASURED = {2048: (67.1e6, 21.1e-6, 36.1e-6), 4096: (134.2e6, 40.4e-6, 69.7e-6), 8192: (268.4e6, 70.2e-6, 118.5e-6)}
MODELS = {  # name: parameters, hidden, GPUs, sequence, micro-batch, global batch (sequences), layouts (TP, PP, SP)
    "Llama-3.1-8B": (8.03e9, 4096, 8, 8192, 1, 128, [(1, 1, False), (2, 1, True), (4, 1, True), (2, 2, True)]),
    "Llama-3.1-70B": (70.6e9, 8192, 64, 8192, 1, 256, [(8, 1, True), (8, 2, True), (8, 4, True), (4, 8, True)]),
}


def bandwidth(hidden: int, gaussian: bool = False) -> float:
    """The measured effective bandwidth (bytes/s) of the noise kernel at ``hidden``."""
    nbytes, uniform, gauss = MEASURED[hidden]
    return nbytes / (gauss if gaussian else uniform)


def layout_row(params: float, hidden: int, gpus: int, seq: int, mb: int, gb: int, layout, mfu: float) -> dict:
    """The arithmetic of one layout: micro-batches, stage times, noise time and shares."""
    tp, pp, sp = layout
    dp = gpus // (tp * pp)
    m = gb // (dp * mb)
    flops = mfu * H200_BF16_FLOPS
    t_mb = 6 * params * mb * seq / (tp * pp * flops)
    t_step = (m + pp - 1) * t_mb
    nbytes = 4 * seq * mb * hidden / (tp if sp else 1)
    noise = {kind: m * nbytes / bandwidth(hidden, kind == "gaussian") for kind in ("uniform", "gaussian")}
    return dict(tp=tp, pp=pp, sp=sp, dp=dp, m=m, t_mb=t_mb, t_step=t_step, nbytes=nbytes, noise=noise)


def section(mfu: float) -> str:
    lines = [
        f"Assumed: {mfu:.0%} MFU of the H200's {H200_BF16_FLOPS / 1e12:.0f} dense bf16 TFLOP/s "
        f"(F = {mfu * H200_BF16_FLOPS / 1e12:.0f} TFLOP/s per GPU); noise bandwidth measured: "
        + ", ".join(
            f"h={h}: {bandwidth(h) / 1e12:.2f} TB/s uniform, {bandwidth(h, True) / 1e12:.2f} Gaussian" for h in MEASURED
        )  # fmt: skip
        + ".",
        "",
        "| model | TP x PP (SP) x DP | m | t_mb (ms) | step (ms) | noise bytes / mb (MB) | noise / step, uniform "
        "| noise share, uniform | Gaussian | teacher share (same size) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (params, hidden, gpus, seq, mb, gb, layouts) in MODELS.items():
        for layout in layouts:
            row = layout_row(params, hidden, gpus, seq, mb, gb, layout, mfu)
            shares = {kind: row["noise"][kind] / row["t_step"] for kind in row["noise"]}
            lines.append(
                f"| {name} | {row['tp']} x {row['pp']} ({'on' if row['sp'] else 'off'}) x {row['dp']} | {row['m']} | "
                f"{row['t_mb'] * 1e3:.1f} | {row['t_step'] * 1e3:.0f} | {row['nbytes'] / 1e6:.1f} | "
                f"{row['noise']['uniform'] * 1e3:.3f} ms | {shares['uniform']:.4%} | {shares['gaussian']:.4%} | "
                f"{2 / (6 + 2):.0%} |"
            )
    student, teacher = MODELS["Llama-3.1-8B"][0], MODELS["Llama-3.1-70B"][0]
    kd = 2 * teacher / (6 * student + 2 * teacher)
    example = layout_row(*MODELS["Llama-3.1-8B"][:6], (1, 1, False), mfu)
    lines += [
        "",
        f"A 70B teacher for the 8B student: 2 x {teacher / 1e9:.1f}B / (6 x {student / 1e9:.2f}B + 2 x "
        f"{teacher / 1e9:.1f}B) = {kd:.0%} of the step's FLOPs (the teacher then dominates; the noise does not).",
        "Worked example (8B, TP 1, PP 1, DP 8, s 8192, mb 1, GB 128 -> m = 16): t_mb = 6 x 8.03e9 x 8192 / "
        f"{mfu * H200_BF16_FLOPS:.3g} = {example['t_mb'] * 1e3:.0f} ms;"
        f" noise per micro-batch = 4 x 8192 x 4096 B / {bandwidth(4096) / 1e12:.2f} TB/s = "
        f"{4 * 8192 * 4096 / bandwidth(4096) * 1e6:.1f} us.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of the H200's bf16 peak")
    print(section(parser.parse_args().mfu))


if __name__ == "__main__":
    main()
