"""`python -m benchmarks [ddp]`: run the side-by-side benchmarks and print a markdown table
(median over alternating rounds). Results worth keeping go into BENCHMARKS.md by hand,
with the command and the date."""

import json
import sys

from . import ddp

BENCHMARKS = {"ddp": ddp}


def main(argv):
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark {unknown[0]!r}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    print("| benchmark | llmsplit tokens/s | peer tokens/s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        result = BENCHMARKS[name].main()
        print(BENCHMARKS[name].to_markdown(result))
        print(json.dumps(result), file=sys.stderr)
    return 0


raise SystemExit(main(sys.argv[1:]))
