"""Print a small text table: the traffic and cost tables under the demos.

Used by notebooks 02 (bytes through device 0 per phase, topics.data_parallel.costs), 03 and 04
(messages and bytes per rank, comm.traffic).

Why here: a table printed under a demo is read like a picture, and every one of them is the same
few lines: a title, a header (if the columns have names), right-aligned numbers.
"""


def print_table(rows, columns, title=None, indent=""):
    """Print `rows` (tuples of values) under `columns`, [(heading, width)], after `title`.

    A positive width aligns right, a negative one left; values are printed with str(). The header
    line is left out when every heading is empty.
    """
    def line(values):
        return indent + " ".join(f"{str(v):{'<' if w < 0 else '>'}{abs(w)}}" for v, (_, w) in
                                 zip(values, columns, strict=True))

    if title:
        print(title)
    if any(heading for heading, _ in columns):
        print(line([heading for heading, _ in columns]))
    for row in rows:
        print(line(row))


def format_bytes(nbytes):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"
