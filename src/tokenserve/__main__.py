import sys

from tokenserve.cli.main import main

sys.exit(main())
