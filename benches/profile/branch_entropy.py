"""Conditional branches of a callgrind run, ranked by how much of a coin toss each one is.

    valgrind --tool=callgrind --collect-jumps=yes --dump-instr=yes --callgrind-out-file=OUT \
        target/release/alloc_patterns --sim --only mixed
    python3 benches/profile/branch_entropy.py OUT 200000 [ROWS]

For every conditional jump: its executions per unit (the second argument: the mixed pattern's
200 000 steps, say) and the share of them taken, p. The sum over branches of min(p, 1 - p) times
executions bounds what branches could mispredict per unit if the predictor learned nothing from
their history or from earlier branches; the largest terms are the candidates for branch-free code.
A real predictor does better wherever a branch follows an earlier one on the same data (the
fourteenth round of docs/allocator-performance.md measured seven such candidates level), so treat
the list as where to look, and measure (benches/gpu/ab.sh). Map an address to source with
`addr2line -e BINARY -i ADDRESS` on a build with line tables.
"""
import collections
import re
import sys


def parse(path):
    executed, taken, function = collections.Counter(), collections.Counter(), {}
    names, current_fn, addr = {}, "", 0
    for line in open(path):
        named = re.match(r"(c?)fn=\((\d+)\)(.*)", line)
        if named:
            if named.group(3).strip():
                names[named.group(2)] = named.group(3).strip()
            if not named.group(1):
                current_fn = names.get(named.group(2), "?")
            continue
        jump = re.match(r"jcnd=(\d+)/(\d+)\s", line)
        if jump:
            # The jump belongs to the instruction of the cost line before it.
            taken[addr] += int(jump.group(1))
            executed[addr] += int(jump.group(2))
            function[addr] = current_fn
            continue
        position = re.match(r"^(0x[0-9a-f]+|\+\d+|-\d+|\*)\s", line)
        if position:
            p = position.group(1)
            if p.startswith("0x"):
                addr = int(p, 16)
            elif p != "*":
                addr += int(p)
    return executed, taken, function


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    executed, taken, function = parse(sys.argv[1])
    units = float(sys.argv[2])
    rows_wanted = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    rows = []
    for addr, n in executed.items():
        per_unit, p = n / units, taken[addr] / n
        rows.append((min(p, 1 - p) * per_unit, per_unit, p, addr, function[addr]))
    rows.sort(reverse=True)
    print(f"coin-toss bound: {sum(r[0] for r in rows):.2f} per unit")
    print("bound  executions  taken  address  function")
    for bound, per_unit, p, addr, fn in rows[:rows_wanted]:
        print(f"{bound:5.2f}  {per_unit:10.2f}  {p:5.2f}  {addr:#x}  {fn[-80:]}")


if __name__ == "__main__":
    main()
