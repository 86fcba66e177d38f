import sys

from insitu.cli import main

sys.exit(main())
