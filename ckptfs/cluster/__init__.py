"""Several nodes on one store: what a node tells the others through the store (``records``: the
directories where it holds unpublished files) and what makes a checkpoint whole
(``markers``: the files that mark one, and what each names; ``dcpmeta``: DCP's ``.metadata``
read without torch). The model's marker gate (model/gate.py) puts them together."""
