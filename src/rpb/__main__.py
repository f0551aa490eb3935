import sys

from rpb.cli import main

sys.exit(main())
