"""Where an in-process simulation's virtual clients run: ``local`` (this process, one after another) or
``ray`` (actors on a Ray cluster). The driver's round — cohort, fold in client order, close, record —
is the same for both (:mod:`fedatoms.simulate`); an engine only trains and evaluates the clients."""

ENGINES = ("local", "ray")
