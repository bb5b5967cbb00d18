import sys

from fedatoms.cli import main

sys.exit(main())
