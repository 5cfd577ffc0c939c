"""The privacy ledger as text: the plain-text table ``nemo noise ledger`` prints (settings, guarantees, assumptions)."""

from __future__ import annotations

import textwrap

from nemo_noise_plugin.privacy.ledger import Guarantee, PrivacyLedger

__all__ = ["format_ledger"]


def format_ledger(ledger: PrivacyLedger) -> str:
    """A plain-text table of the ledger: settings, per-token and per-sequence guarantees, then the assumptions."""
    rows: list[tuple[str, str, str]] = [("mechanism", ledger.mechanism, "" if ledger.enabled else "disabled")]
    if ledger.clip_norm is not None:
        rows.append(("clip norm C", _number(ledger.clip_norm), "embeddings clipped to |x| <= C"))
        rows.append(("sensitivity 2C", _number(ledger.sensitivity), "L2, one token replaced"))
    if ledger.sigma is not None:
        rows.append(("sigma_dp", _number(ledger.sigma), f"{ledger.calibration} calibration"))
    if ledger.eta is not None:
        rows.append(("eta", _number(ledger.eta), "epsilon per unit L2 distance"))
    if ledger.laplace_scale is not None:
        rows.append(("laplace scale b", _number(ledger.laplace_scale), "per coordinate; 1/b epsilon per unit L1"))
    if ledger.hidden_size is not None:
        rows.append(("hidden size d", str(ledger.hidden_size), ""))
    if ledger.expected_noise_norm is not None:
        note = "d / eta" if ledger.eta is not None else "~ sigma_dp sqrt(d)"
        if ledger.laplace_scale is not None:
            note = "~ b sqrt(2d)"
        if ledger.clip_norm is not None:
            note += f"; {ledger.expected_noise_norm / ledger.clip_norm:.4g} x C"
        rows.append(("expected noise norm E|z|", _number(ledger.expected_noise_norm), note))
    rows.append(("sequence length L", str(ledger.sequence_length), ""))
    rows.append(("epochs E", str(ledger.epochs), f"{ledger.releases} token releases per sequence"))

    sections = [("Settings", rows)]
    if ledger.per_token or ledger.per_sequence:
        token_rows = [_guarantee_row(guarantee) for guarantee in ledger.per_token]
        if ledger.token_rho is not None:
            token_rows.append(("rho (zCDP)", _number(ledger.token_rho), "(2C)^2 / (2 sigma_dp^2)"))
        sequence_rows = []
        if ledger.sequence_rho is not None:
            sequence_rows.append(("rho (zCDP)", _number(ledger.sequence_rho), "L E rho_token"))
        sequence_rows += [_guarantee_row(guarantee) for guarantee in ledger.per_sequence]
        sections.append(("Per token (one token replaced, one release)", token_rows))
        sections.append(
            (
                f"Per sequence (all L = {ledger.sequence_length} tokens replaced, E = {ledger.epochs} epochs)",
                sequence_rows,
            )
        )

    width = max(len(row[0]) for _, section_rows in sections for row in section_rows)
    value_width = max(len(row[1]) for _, section_rows in sections for row in section_rows)
    lines = [f"Privacy ledger: {ledger.mechanism}"]
    for title, section_rows in sections:
        lines.append("")
        lines.append(title)
        for label, value, note in section_rows:
            lines.append(f"  {label:<{width}}  {value:<{value_width}}  {note}".rstrip())
    lines.append("")
    lines.append("Assumptions")
    for text in ledger.assumptions:
        lines.append(
            textwrap.fill(text, width=_WRAP, initial_indent="  - ", subsequent_indent="    ", break_on_hyphens=False)
        )
    return "\n".join(lines)


_WRAP = 110


def _guarantee_row(guarantee: Guarantee) -> tuple[str, str, str]:
    if guarantee.epsilon is None:
        return ("epsilon", "unbounded", guarantee.how)
    if guarantee.delta == 0.0:
        return ("epsilon (pure)", _number(guarantee.epsilon), guarantee.how)
    return (f"epsilon at delta={guarantee.delta:g}", _number(guarantee.epsilon), guarantee.how)


def _number(value: float) -> str:
    return f"{value:.6g}"
