"""Show each head's learned distance preference (w, v and the f-curve) of a distance-aware checkpoint.

``diffattn heads CKPT``: the command line of :mod:`diffattn.eval.heads` (the table, and the plot with --plot).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diffattn.cli.options import model_folder_refused
from diffattn.eval.measures import DEFAULT_DISTANCES
from diffattn.system.atomic_files import printable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run folder (diffattn train --out DIR) or its ckpt/ folder, of a distance /"
                   " diff_distance model")
    p.add_argument("--plot", metavar="PNG", help="also plot the f-curves per head to this image file (.png, .pdf, "
                   ".svg, ...; its folder must exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --plot file (default: refuse)")
    p.add_argument("--distances", default=None,
                   help="comma-separated distances at which to print f (default: "
                        f"{','.join(map(str, DEFAULT_DISTANCES))} up to the model's context, and context − 1, "
                        "where each head's preference is measured)")


def check_plot_path(path: str, *, overwrite: bool, checkpoint: Path | None = None) -> None:
    """Refuse (OutputError) a --plot file that cannot be written, exists without --overwrite, or has an image
    format matplotlib does not write; nothing is created."""
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.output_guard import OutputError, check_output_file

    check_output_file(path, overwrite=overwrite, what="heads", flag="--plot", inside_forbidden=checkpoint)
    ext = Path(path).suffix.lower().lstrip(".")
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase  # (matplotlib, as above)

    known = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in known:  # no extension: matplotlib writes a PNG
        raise OutputError(f"heads --plot {path}: matplotlib cannot write .{ext} files; use one of "
                          f"{', '.join('.' + k for k in sorted(known))}")


def run(args: argparse.Namespace) -> int:
    if (refused := model_folder_refused(args.checkpoint)) is not None:  # before torch is imported
        return refused
    # the library: imported when the command runs (--help imports no torch)
    from diffattn.checkpoint.format import CheckpointError, load_checkpoint
    from diffattn.checkpoint.output_guard import OutputError
    from diffattn.checkpoint.run_folder import resolve_checkpoint_dir
    from diffattn.eval.format import count
    from diffattn.eval.heads import distances_for, format_table, model_head_table, plot_heads

    try:
        given = [int(x) for x in str(args.distances).split(",") if x.strip()] if args.distances else None
        where = resolve_checkpoint_dir(args.checkpoint)
        if args.plot:  # before loading anything: an unwritable plot must not fail after the work is done
            check_plot_path(args.plot, overwrite=getattr(args, "overwrite", False), checkpoint=where)
        checkpoint = load_checkpoint(where)
        attn, context = checkpoint.model_config.attention, checkpoint.model_config.max_seq_len
        distances = given or distances_for(context)  # by default: the distances this model sees
        rows = model_head_table(checkpoint.state_dict, attn, distances, context=context)
    except (CheckpointError, OutputError, ValueError) as e:
        print(f"error: {printable(e)}", file=sys.stderr)
        return 2
    print(f"{args.checkpoint}: attention {attn}, {count(checkpoint.model_config.n_layers, 'layer')}; "
          "f(x; v) = (1+e^v)/(1+e^(v-x))")
    print(format_table(rows))
    if args.plot:
        plot_heads(rows, args.plot, context - 1)
        print(f"plot written to {args.plot}")
    return 0
