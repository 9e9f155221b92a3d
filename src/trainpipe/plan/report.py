"""The plan as tables: decisions with their rules, the memory breakdown, compute and cost.

The tables fit the console (COLUMNS, 80 when piped) without cutting anything: the short columns (a setting's name, its
value, where it came from, the figures) keep their whole width and never wrap, the prose columns (rule, what to watch)
wrap at spaces, and nothing is ever cut off with "…": a cell too wide for what is left folds onto the next line."""

from __future__ import annotations

from trainpipe import ui
from trainpipe.plan.family_plan import family_lines

GIB = 1024**3
PROSE_MIN = 14  # the narrowest a rule / what-to-watch column may get before the table gives way to a list


def _whole_width(heads, columns) -> int:
    """The width of a table whose every word (of a header or a cell) stays whole: 3 per column of borders and padding."""
    return sum(max([*(len(w) for w in h.split()), *(len(c) for c in cells)]) for h, cells in zip(heads, columns)) + 3 * len(heads) + 1


def _indented(text: str):
    from rich.padding import Padding
    from rich.text import Text

    return Padding(Text(text), (0, 0, 0, 4))


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def print_plan(plan: dict) -> None:
    con = ui.console()
    for part in (_print_model, _print_decisions, _print_memory, _print_family, _print_recommendation, _print_compute, _print_ranking):
        part(con, plan)


def _print_family(con, plan: dict) -> None:
    """Memory and time of a tabular, image or custom model's traced step (plan/family_plan.py)."""
    if plan.get("family"):
        for line in family_lines(plan["family"]):
            con.print(line, markup=False, soft_wrap=True)


def _print_model(con, plan: dict) -> None:
    """The model line and the plan's notes."""
    m = plan["model"]
    if m:
        trainable = f"{m['trainable_params']:,} trainable ({100 * m['trainable_params'] / max(1, m['params']):.2f} %)" if m.get("trainable_params") is not None else "trainable: not sized"
        con.print(f"[bold]{m['id']}[/] ({m['source']}, {m['model_type']}): {m['params'] / 1e9:.3f}B parameters, {trainable}",
                  markup=True, highlight=False, soft_wrap=True)
        if m.get("note"):
            con.print(f"note: {m['note']}", markup=False, soft_wrap=True)
    for n in plan.get("notes") or ():
        con.print(f"note: {n}", markup=False, soft_wrap=True)


def _print_decisions(con, plan: dict) -> None:
    """Every decision with its rule: a table that cuts nothing, or one entry per choice when the console is narrow."""
    from rich.table import Table

    with_source = any("source" in d for d in plan["decision"])
    t = Table(title="plan (what `trainpipe run` executes)" if with_source else "decisions")
    short = [[d["key"] for d in plan["decision"]], [str(d["value"]) for d in plan["decision"]]]
    if with_source:
        short.append([d.get("source", "") for d in plan["decision"]])
    heads = ("choice", "value", "from")[:len(short)]
    # the short columns whole (never wrapped), the prose folded into what is left; 3 per column of borders and padding
    if _whole_width(heads, short) + 2 * (PROSE_MIN + 3) <= con.width:
        for h in heads:
            t.add_column(h, no_wrap=True)
        for c in ("rule", "what to watch"):
            t.add_column(c, overflow="fold")
        for d in plan["decision"]:
            t.add_row(d["key"], str(d["value"]), *((d.get("source", ""),) if with_source else ()), d["rule"], d.get("watch", ""))
        con.print(t)
    else:  # too narrow for a table that cuts nothing: one entry per choice, wrapped at spaces
        con.print(t.title, markup=False, soft_wrap=False, style="italic")
        for d in plan["decision"]:
            src = f" (from {d['source']})" if with_source and d.get("source") else ""
            con.print(f"{d['key']} = {d['value']}{src}", markup=False, highlight=False, style="bold")
            con.print(_indented(f"rule: {d['rule']}"))
            if d.get("watch"):
                con.print(_indented(f"watch: {d['watch']}"))


def _print_memory(con, plan: dict) -> None:
    """The memory per device and what fits."""
    from rich.table import Table

    pd = plan["memory"]["per_device"]
    if pd is None:
        pd = {}
    if pd:
        mt = Table(title="memory per device (GiB)")
        mt.add_column("piece", overflow="fold")
        mt.add_column("GiB", justify="right", overflow="fold")
        for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes", "total_bytes"):
            mt.add_row(k.replace("_bytes", ""), _gib(pd[k]))
        if pd.get("cpu_offload_bytes"):
            mt.add_row("offloaded to CPU", _gib(pd["cpu_offload_bytes"]))
        con.print(mt)
    fits = plan["memory"]["fits"]
    if fits and plan.get("fits") is False:  # the GPU memory is not the whole answer (host RAM, ...): never print `fits: yes` then
        con.print("GPU memory: " + ", ".join(f"{g} {'enough' if ok else 'too little'}" for g, ok in fits.items()) + "; overall: does not fit",
                  markup=False, soft_wrap=True)
    elif fits:
        con.print("fits: " + ", ".join(f"{g} {'yes' if ok else 'no'}" for g, ok in fits.items()), markup=False, soft_wrap=True)
    if plan.get("fits") is False:
        con.print(f"DOES NOT FIT: {plan.get('why_not')}", markup=False, soft_wrap=True)


def _print_recommendation(con, plan: dict) -> None:
    """The headline rule and the recommended (or closest) setup."""
    if plan.get("headline"):
        con.print(f"headline ({plan['headline']['objective']}): {plan['headline']['rule']}", markup=False, soft_wrap=True)
    r = plan["recommendation"]
    con.print(f"{'recommendation' if plan.get('fits', True) else 'closest plan (does not fit)'}: {r['method']} on {r['num_gpus']} x {r['gpu']} ({r['strategy']}{', offload ' + r['offload'] if r['offload'] != 'none' else ''}"
              f"{', sequence parallel ' + str(plan['parallel']['sequence']) if (plan.get('parallel') or {}).get('sequence') else ''}), "
              f"{r['precision']}, micro-batch {r['micro_batch']} x accumulation {r['gradient_accumulation']} x "
              f"{str(plan['parallel']['data']) + ' data-parallel replica(s)' if plan.get('parallel') else str(r['num_gpus']) + ' device(s)'} = effective batch {r['effective_batch']}, "
              f"gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}, lr {r['learning_rate']:g}", markup=False, soft_wrap=True)


def _print_compute(con, plan: dict) -> None:
    """What the plan assumed (sequence length, batch), compute, time and cost (with the tokens known), else FLOPs per
    token, and the interconnect the scaling assumes."""
    a = plan.get("assumed")
    if a:
        con.print(f"assumed: sequence length {a['seq_len']} tokens ({a['seq_len_from']}), micro-batch {a['micro_batch']} x accumulation "
                  f"{a['gradient_accumulation']} = effective batch {a['effective_batch']} ({a['batch_from']})", markup=False, soft_wrap=True)
    c = plan.get("compute")
    if c and c.get("interconnect"):
        con.print(f"interconnect: {c['interconnect']}", markup=False, soft_wrap=True)
    if c:
        if c.get("tokens_known"):
            cost = plan["cost"]
            con.print(f"compute: {c['flops']:.3g} FLOPs for {c['tokens']:.3g} tokens at MFU {c['mfu_assumed']:.0%}: {c['hours']:.2f} h "
                      f"({c['gpu_hours']:.1f} GPU-h); cost on-demand ${cost['on_demand_usd']:,.2f}, spot ${cost['spot_usd']:,.2f} "
                      f"(checkpoint every {60 * cost['checkpoint_interval_hours']:.0f} min, {100 * cost['spot_waste_fraction']:.1f} % rework at "
                      f"{cost['preemptions_per_hour']:g} preemptions/h)", markup=False, soft_wrap=True)
        else:
            con.print(f"compute: {c['flops_per_token']:.3g} FLOPs per token; give --tokens N (or --examples N --avg-len L) for time and cost", markup=False, soft_wrap=True)


def _print_ranking(con, plan: dict) -> None:
    """The setups that fit, cheapest (or fastest) first."""
    from rich.table import Table

    if plan.get("ranking"):
        by_time = (plan.get("headline") or {}).get("objective") == "time"
        rt = Table(title="fastest setups that fit" if by_time else "cheapest setups that fit")
        rows = [(row["gpu"], str(row["num_gpus"]), row["method"], row["strategy"], f"{row['hours']:.2f}", f"{row['on_demand_usd']:,.2f}",
                 f"{row['spot_usd']:,.2f}", f"{row['memory_margin_gib']:.1f}") for row in plan["ranking"]]
        heads = ("gpu", "n", "method", "strategy", "hours", "on-demand $", "spot $", "memory margin GiB")
        for i, col in enumerate(heads):  # a header wraps at its spaces; a cell (a GPU name, a figure) is one word
            rt.add_column(col, overflow="fold", justify="left" if i in (0, 2, 3) else "right")
        for r in rows:
            rt.add_row(*r)
        if _whole_width(heads, list(zip(*rows)) if rows else [()] * len(heads)) <= con.width:
            con.print(rt)
        else:  # too narrow: one line per setup, wrapped at spaces
            con.print(rt.title, markup=False, style="italic")
            for i, r in enumerate(rows, 1):
                con.print(f"{i}. {r[0]} x {r[1]}, {r[2]}, {r[3]}", markup=False, highlight=False)
                con.print(_indented(f"{r[4]} h, ${r[5]} on-demand, ${r[6]} spot, {r[7]} GiB spare"))
