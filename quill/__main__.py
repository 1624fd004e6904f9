import sys

from quill.cli import main

sys.exit(main())
