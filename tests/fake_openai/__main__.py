"""Run the fake server on its own: ``python tests/fake_openai --port 8000 --config '{"slots": 8}'``
(or ``python -m fake_openai`` with tests/ on the path)."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: Python put the folder itself on the path, the package needs its parent
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from fake_openai.server import main  # noqa: E402

main()
