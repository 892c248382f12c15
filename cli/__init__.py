"""The ``eagle3`` command: the entry point that decides how stages run (as Prefect flows).

It lives outside the ``eagle3`` library so that it may import ``flows/`` while the library never does.
"""
