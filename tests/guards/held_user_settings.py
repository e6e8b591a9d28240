"""A module of a user's own code that a forward reads through (``held_user_settings.SCALE``), for
``test_held_containers.py``."""

import numpy as np

SCALE = 2.0
TABLE = np.array([2.0])


def act(x):
    return x * 2.0


def reset():
    """Puts every global back as it was."""
    global SCALE, TABLE, act
    SCALE, TABLE = 2.0, np.array([2.0])

    def act(x):  # noqa: F811 - a fresh function with the first one's code
        return x * 2.0
