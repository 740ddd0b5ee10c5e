"""The live terminal view: ``views.live``'s snapshot drawn with rich (``table``: a table of ranks,
a progress bar, the primary verdict and the latest alerts), or, where the output is no terminal,
one plain line every 10 s (``text``: no escape codes at all).

``run_view.RunView`` is what ``stepwatch run`` hands the launcher: it redraws on a thread of its
own and, on a terminal, carries the training's output through a pseudo-terminal of its own
(``pump.OutputPump``) so the program's lines scroll above the view, never torn by it, while the
program still sees a terminal. ``top.watch_run`` is ``stepwatch top``.
"""
