"""The web surfaces: the dashboard (``stepwatch ui``, ``run``/``serve --ui-port``) and the one-file
HTML report (``stepwatch report``, ``run --report``). They render what ``stepwatch.views``
computes; the page's script and style and the charting library (uPlot, MIT licence, its licence
text beside it) are package data (``assets/``), served or inlined, never fetched from the
internet.
"""
