"""What the surfaces show: the data behind the live terminal view, the web dashboard and the HTML
report, computed once from the history store and the analysis, so no two views disagree.

It sits below the command line, the launcher and the aggregator (all three import it) and reads
only ``store/``, ``artifacts/`` and ``analysis/``; rendering (rich, HTML) lives with each surface.
"""
