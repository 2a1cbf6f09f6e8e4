"""The report room: records in, tables, figures and pages out.

build.py      `bench report`: reads the shelf once, writes tables/, plots/, report.html, README blocks
tables.py     the summary frames every rendering draws (per task, overall, speed, acceptance)
plots.py      the figures, from those frames
html.py       report.html
summary.py    `python -m bench.report.summary`: a quick table of one results folder
revisions.py  a series' revisions side by side
claims.py     the issues' goals and the papers' claims, checked against what was measured
paper_tables.py, paper_tables.json   the papers' own tables beside our cells
scaling.py    τ against training tokens
serving_gap.py  the τ training predicted beside the τ the grid measured

The report reads records and never imports a method: what it needs is in the records.
"""
