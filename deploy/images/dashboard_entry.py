"""The dashboard image's command: ``fedatoms-dashboard serve …`` = ``fedatoms dashboard serve …``.

It runs ``python -m dashboard_api``, which mounts only the dashboard's parser: the full ``fedatoms``
parser imports the simulator, and torch with it, which this image does not carry.
"""

import sys

from dashboard_api.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
