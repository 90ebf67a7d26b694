import sys

from recpipe.cli import main

sys.exit(main())
