"""The launcher inside a real Jupyter kernel: functions defined in cells, output, failures."""

import nbformat
from nbclient import NotebookClient

CELLS = [
    "import os, torch, torch.distributed as dist\nfrom dpcourse import launch, LaunchError",
    # a big op in the kernel first: forked ranks then hang in their first big op
    # unless the launcher drops them to one thread (FINDINGS.md)
    "x = torch.randn(2000, 2000); y = x @ x",
    "def f(scale):\n    t = torch.randn(1000, 1000) @ torch.randn(1000, 1000)\n"
    "    print('hello from', dist.get_rank())\n    s = torch.tensor([float(dist.get_rank())])\n"
    "    dist.all_reduce(s)\n    return s.item() * scale",
    "print(launch(f, 2, 10))",
    "def g():\n    if dist.get_rank() == 1:\n        raise KeyError('from the cell')\n"
    "try:\n    launch(g, 2)\nexcept LaunchError as e:\n    print('culprit', e.rank)",
    "print('children', len([p for p in os.listdir('/proc') if p.isdigit() and "
    "open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1] == str(os.getpid())]))",
]


def test_a_function_defined_in_a_cell_runs_on_ranks_without_writing_to_stderr():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outputs = [o for c in nb.cells for o in c.outputs]
    stderr = [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    assert not errors, errors
    assert not stderr, stderr
    text = "".join(o.text for o in outputs if o.output_type == "stream")
    assert "[rank 0] hello from 0" in text and "[rank 1] hello from 1" in text
    assert "[10.0, 10.0]" in text
    assert "culprit 1" in text
    assert "children 0" in text
