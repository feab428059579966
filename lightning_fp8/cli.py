"""Console entry point: `lightning-fp8 demo [...]` and `lightning-fp8 report LOG_DIR [-o FILE]`."""
from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: lightning-fp8 <command> [options]

commands:
  demo      train a small char-GPT twice (FP8 and BF16) on the embedded corpus and compare
  report    write the HTML precision dashboard of a run: lightning-fp8 report LOG_DIR [-o FILE]
"""


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from lightning_fp8.demo.run import main as demo_main

        return demo_main(rest)
    if command == "report":
        from lightning_fp8.report import main as report_main

        return report_main(rest)
    print(f"lightning-fp8: unknown command {command!r}; valid commands: demo, report\n", file=sys.stderr)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
