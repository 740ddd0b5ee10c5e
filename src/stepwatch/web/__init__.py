"""The web surfaces: the dashboard (``stepwatch ui``, ``run``/``serve --ui-port``) and the one-file
HTML report (``stepwatch report``, ``run --report``). They render what ``stepwatch.views``
computes; the page's script and style are package data (``assets/``), the charts are Plotly's
bundle from the installed ``plotly`` package (MIT licence), served or inlined, never fetched
from the internet.
"""
