"""Conditional branches of a callgrind run, ranked by how much of a coin toss each one is.

    valgrind --tool=callgrind --collect-jumps=yes --dump-instr=yes --callgrind-out-file=OUT \
        target/release/alloc_patterns --sim --only mixed
    python3 benches/profile/branch_entropy.py OUT 200000 [ROWS]
    python3 benches/profile/branch_entropy.py --taken OUT 200000 [ROWS]

For every conditional jump: its executions per unit (the second argument: the mixed pattern's
200 000 steps, say) and the share of them taken, p. The sum over branches of min(p, 1 - p) times
executions bounds what branches could mispredict per unit if the predictor learned nothing from
their history or from earlier branches; the largest terms are the candidates for branch-free code.
A real predictor does better wherever a branch follows an earlier one on the same data (a branch whose
outcome repeats an earlier branch's costs nothing extra however high its entropy), so treat the list as
where to look, and measure (benches/gpu/ab.sh). Map an address to source with
`addr2line -e BINARY -i ADDRESS` on a build with line tables.

`--taken` ranks the other way round, for code layout: conditional jumps taken more than 90% of the
time, by taken jumps per unit. Such a jump is predicted, but the common path then jumps over the rare
one instead of falling through (each taken jump ends the front end's fetch block); the fix is a hint
on the rare side (`std::hint::cold_path`), measured the same way: taken jumps per step before and
after, and the time with benches/gpu/ab.sh.
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
    args = sys.argv[1:]
    by_taken = bool(args) and args[0] == "--taken"
    if by_taken:
        args = args[1:]
    if len(args) < 2:
        raise SystemExit(__doc__)
    sys.argv = [sys.argv[0]] + args
    executed, taken, function = parse(sys.argv[1])
    units = float(sys.argv[2])
    rows_wanted = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    if by_taken:
        print_taken(executed, taken, function, float(sys.argv[2]),
                    int(sys.argv[3]) if len(sys.argv) > 3 else 25)
        return
    rows = []
    for addr, n in executed.items():
        per_unit, p = n / units, taken[addr] / n
        rows.append((min(p, 1 - p) * per_unit, per_unit, p, addr, function[addr]))
    rows.sort(reverse=True)
    print(f"coin-toss bound: {sum(r[0] for r in rows):.2f} per unit")
    print("bound  executions  taken  address  function")
    for bound, per_unit, p, addr, fn in rows[:rows_wanted]:
        print(f"{bound:5.2f}  {per_unit:10.2f}  {p:5.2f}  {addr:#x}  {fn[-80:]}")


def print_taken(executed, taken, function, units, rows_wanted):
    """Conditional jumps per unit, taken ones per unit, and the mostly-taken jumps ranked."""
    print(f"conditional jumps {sum(executed.values()) / units:.1f} per unit, "
          f"taken {sum(taken.values()) / units:.1f}")
    rows = [(taken[a] / units, taken[a] / n, a, function[a])
            for a, n in executed.items() if taken[a] > 0.9 * n]
    rows.sort(reverse=True)
    print(f"taken more than 90% of the time: {sum(r[0] for r in rows):.1f} per unit")
    print("taken  share  address  function")
    for per_unit, p, addr, fn in rows[:rows_wanted]:
        print(f"{per_unit:5.2f}  {p:5.3f}  {addr:#x}  {fn[-80:]}")


if __name__ == "__main__":
    main()
