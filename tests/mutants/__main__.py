import sys

from tests.mutants.harness import main

sys.exit(main())
