"""Stage ``vocab``: the draft vocabulary (d2t, t2d) from supervised-token counts.

``mapping`` builds, saves and loads the mapping; ``stage`` runs it over a run directory.
"""
