"""Planted bugs for 02_dataparallel: each must lose the listed cells with a message saying why.

Each variant plants one bug in `scatter` and one in `MiniDataParallel` (six variants, six
bugs per exercise). MiniDataParallel calls the learner's scatter, so each pair is chosen for
the scatter bug not to hide the MiniDataParallel one. Not planted: "gather on the wrong
device", which CPU devices cannot tell apart; the hidden GPU check covers it where a machine
has two GPUs.
"""


# ---- exercise 1: scatter ----------------------------------------------------------------------
def scatter_with(tensor_piece="torch.tensor_split(o, len(used))[i].to(used[i])",
                 used="devices if b is None else devices[:max(1, min(len(devices), b))]",
                 sequences="""        if isinstance(o, tuple):
            return tuple(piece(v, i) for v in o)
        if isinstance(o, list):
            return [piece(v, i) for v in o]
""",
                 mapping="{k: piece(v, i) for k, v in o.items()}", other="o", pieces="len(used)"):
    """The solution's scatter with one part swapped for a buggy one."""
    return f"""
def scatter(obj, devices):
    def batch_size(o):
        if isinstance(o, torch.Tensor):
            return len(o)
        values = o.values() if isinstance(o, dict) else o if isinstance(o, (tuple, list)) else ()
        for v in values:
            b = batch_size(v)
            if b is not None:
                return b
        return None

    b = batch_size(obj)
    used = {used}

    def piece(o, i):
        if isinstance(o, torch.Tensor):
            return {tensor_piece}
{sequences}        if isinstance(o, dict):
            return {mapping}
        return {other}

    return [piece(obj, i) for i in range({pieces})]
"""


SCATTER_DATAPARALLEL_SIZES = scatter_with(
    tensor_piece="o[i * -(-b // len(used)):(i + 1) * -(-b // len(used))].to(used[i])",
    pieces="len(used) if b is None else -(-b // -(-b // len(used)))")
SCATTER_DROPS_NON_TENSORS = scatter_with(other="None")
SCATTER_EMPTY_PIECES = scatter_with(used="devices")
SCATTER_DICT_WHOLE = scatter_with(mapping="o")
SCATTER_TUPLES_BECOME_LISTS = scatter_with(sequences="""        if isinstance(o, (tuple, list)):
            return [piece(v, i) for v in o]
""")
SCATTER_ONLY_FLOATS = scatter_with(
    tensor_piece="torch.tensor_split(o, len(used))[i].to(used[i]) if o.is_floating_point() else o")


# ---- exercise 2: MiniDataParallel -------------------------------------------------------------------
HEAD = '''
class MiniDataParallel(nn.Module):
    def __init__(self, module, devices, output_device=None):
        super().__init__()
        self.module = module
        self.devices = [torch.device(d) for d in devices]
        self.output_device = torch.device(output_device) if output_device is not None else self.devices[0]

    def forward(self, *inputs, **kwargs):
        pieces = scatter((inputs, kwargs), self.devices)
        replicas = replicate(self.module, self.devices[:len(pieces)])
'''

GATHER = '''
        def gather(outs):
            first = outs[0]
            if isinstance(first, torch.Tensor):
                return torch.cat([o.to(self.output_device) for o in outs])
            if isinstance(first, tuple):
                return tuple(gather(parts) for parts in zip(*outs))
            if isinstance(first, list):
                return [gather(parts) for parts in zip(*outs)]
            if isinstance(first, dict):
                return {k: gather([o[k] for o in outs]) for k in first}
            return first

        return gather(results)
'''

THREADS = '''        results, errors = [None] * len(pieces), [None] * len(pieces)
        grad_enabled = torch.is_grad_enabled()

        def run(i):
            {set_grad}
            try:
                args, kw = pieces[i]
                results[i] = {call}
            except Exception as exc:
                errors[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pieces))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for error in errors:
            if error is not None:
                raise error
'''


def mini(set_grad="torch.set_grad_enabled(grad_enabled)", call="replicas[i](*args, **kw)", gather=GATHER):
    return HEAD + THREADS.format(set_grad=set_grad, call=call) + gather


MINI_SEQUENTIAL = HEAD + '''        results = [r(*args, **kw) for r, (args, kw) in zip(replicas, pieces)]
''' + GATHER

MINI_COMPLETION_ORDER = HEAD + '''        results, lock = [], threading.Lock()
        grad_enabled = torch.is_grad_enabled()

        def run(i):
            torch.set_grad_enabled(grad_enabled)
            args, kw = pieces[i]
            out = replicas[i](*args, **kw)
            with lock:
                results.append(out)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pieces))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
''' + GATHER

MINI_DETACHED = mini(gather=GATHER.replace("o.to(self.output_device) for o in outs",
                                           "o.detach().to(self.output_device) for o in outs"))
MINI_TENSORS_ONLY = mini(gather='''
        return torch.cat([o.to(self.output_device) for o in results])
''')
MINI_DROPS_KWARGS = mini(call="replicas[i](*args)")
MINI_GRAD_MODE_NOT_CARRIED = mini(set_grad="pass")

VARIANTS = {
    "dataparallel_sizes_and_replicas_in_sequence": {
        "cells": {"scatter": SCATTER_DATAPARALLEL_SIZES, "mini_data_parallel": MINI_SEQUENTIAL},
        "loses": {"test_scatter_basic": "[2] has shape (3, 2), expected (2, 2)",
                  "test_scatter_structures": "has shape (3, 2), expected (2, 2)",
                  "test_mini_data_parallel_basic": "the replicas did not run in parallel",
                  "test_mini_data_parallel_edge_cases": "the replicas did not run in parallel"},
    },
    "drops_non_tensors_and_gathers_in_finishing_order": {
        "cells": {"scatter": SCATTER_DROPS_NON_TENSORS, "mini_data_parallel": MINI_COMPLETION_ORDER},
        "loses": {"test_scatter_structures": "['scale'] is None, expected 0.5",
                  "test_mini_data_parallel_edge_cases": "gather the replicas' outputs in device order"},
        "keeps": ["test_scatter_basic"],
    },
    "empty_pieces_and_detached_outputs": {
        "cells": {"scatter": SCATTER_EMPTY_PIECES, "mini_data_parallel": MINI_DETACHED},
        "loses": {"test_scatter_structures": "scatter(2 rows, 4 CPU devices) has 4 elements, expected 2",
                  "test_mini_data_parallel_basic": "does not require grad",
                  "test_mini_data_parallel_edge_cases": "does not require grad"},
        "keeps": ["test_scatter_basic"],
    },
    "dict_not_split_and_tuple_outputs_lost": {
        "cells": {"scatter": SCATTER_DICT_WHOLE, "mini_data_parallel": MINI_TENSORS_ONLY},
        "loses": {"test_scatter_structures": "['offset'] has shape (7,), expected (3,)",
                  "test_mini_data_parallel_edge_cases": "returning (scores, (embedding, 'label')) raised"},
        "keeps": ["test_scatter_basic", "test_mini_data_parallel_basic"],
    },
    "tuples_become_lists_and_keywords_dropped": {
        "cells": {"scatter": SCATTER_TUPLES_BECOME_LISTS, "mini_data_parallel": MINI_DROPS_KWARGS},
        "loses": {"test_scatter_structures": "should be a tuple",
                  "test_mini_data_parallel_edge_cases": "with keyword inputs scale=0.5"},
        "keeps": ["test_scatter_basic", "test_mini_data_parallel_basic"],
    },
    "labels_not_split_and_grad_mode_not_carried": {
        "cells": {"scatter": SCATTER_ONLY_FLOATS, "mini_data_parallel": MINI_GRAD_MODE_NOT_CARRIED},
        "loses": {"test_scatter_structures": "['offset'] has shape (7,), expected (3,)",
                  "test_mini_data_parallel_edge_cases":
                  "under torch.no_grad() the replicas of MiniDataParallel ran"},
        "keeps": ["test_scatter_basic", "test_mini_data_parallel_basic"],
    },
}
