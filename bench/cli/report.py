"""`bench report`: tables, figures and report.html from run records."""

from __future__ import annotations

import click


@click.command()
@click.option("--results", "results_dir", default="results", show_default=True, help="folder of run records")
@click.option("--target", "targets", multiple=True, help="only this target (repeatable; default all)")
@click.option("--task", "tasks", multiple=True, help="only this task (repeatable; default all)")
@click.option("--method", "methods", multiple=True, help="only this method (repeatable; default all)")
@click.option("--tag", "tags", multiple=True, help="only this record series, with its revisions (repeatable)")
@click.option("--out", "out_dir", default="plots", show_default=True, help="folder for report.html, figures/, tables/")
@click.option("--readme", is_flag=True,
              help="also rewrite the generated blocks: the headline in README.md, the references in results/README.md, "
                   "and the drafters, profile, tuned and revisions blocks where their markers are")
@click.option("--load-tag", "load_tags", multiple=True,
              help="a load sweep's series (make load-sweep: load1, load2, ...) drawn in the load figure only, "
                   "beside the selection's tables (repeatable)")
@click.option("--tuned-tag", "tuned_tags", multiple=True,
              help="the grid at each method's tuned budget (python -m bench.grid --budget auto: grid-auto), "
                   "shown beside the selection (repeatable)")
def report(results_dir, targets, tasks, methods, tags, out_dir, readme, load_tags, tuned_tags) -> None:
    """Tables (Markdown, LaTeX, CSV), figures (PNG, SVG) and one HTML report from run records."""
    from pathlib import Path

    from bench.report.build import make_report
    from bench.report.tables import display_table, to_markdown

    result = make_report(Path(results_dir), Path(out_dir), targets, tasks, methods, tags,
                         Path("README.md") if readme else None, load_tags=load_tags, tuned_tags=tuned_tags)
    click.echo(to_markdown(display_table(result["tables"].overall)))
    for problem in result["problems"]:
        click.echo(f"{problem.kind}: {problem.where}: {problem.detail}", err=True)
    click.echo(f"report: {result['html']} ({len(result['files'])} tables and figures beside it)")
