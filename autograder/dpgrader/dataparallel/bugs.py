"""Planted bugs for 02_dataparallel: each must lose the listed cells with a message saying why.

Each graded variant plants one bug in `scatter` and one in `MiniDataParallel` (six variants, six
bugs per exercise). MiniDataParallel calls the learner's scatter, so each pair is chosen for the
scatter bug not to hide the MiniDataParallel one. Not planted: "gather on the wrong device", which
CPU devices cannot tell apart; the hidden GPU check covers it where a machine has two GPUs.
"""

from dpgrader.planted import Bug, Variant

# ---- scatter: the lines the bugs edit ---------------------------------------------------------------
TENSOR_PIECE = "            return torch.tensor_split(o, len(used))[i].to(used[i])\n"
USED = "    used = devices if b is None else devices[:max(1, min(len(devices), b))]\n"
SEQUENCES = ("        if isinstance(o, tuple):\n"
             "            return tuple(piece(v, i) for v in o)\n"
             "        if isinstance(o, list):\n"
             "            return [piece(v, i) for v in o]\n")
PIECES = "    return [piece(obj, i) for i in range(len(used))]\n"

# ---- MiniDataParallel: the lines the bugs edit --------------------------------------------------------
THREADS = '''        results, errors = [None] * len(pieces), [None] * len(pieces)
        grad_enabled = torch.is_grad_enabled()

        def run(i):
            torch.set_grad_enabled(grad_enabled)
            try:
                args, kw = pieces[i]
                results[i] = replicas[i](*args, **kw)
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread below
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
CALL = "                results[i] = replicas[i](*args, **kw)\n"
GATHER = '''        def gather(outs):
            first = outs[0]
            if isinstance(first, torch.Tensor):
                return torch.cat([o.to(self.output_device) for o in outs])
            if isinstance(first, tuple):
                return tuple(gather(parts) for parts in zip(*outs, strict=True))
            if isinstance(first, list):
                return [gather(parts) for parts in zip(*outs, strict=True)]
            if isinstance(first, dict):
                return {k: gather([o[k] for o in outs]) for k in first}
            return first

        return gather(results)
'''

BUGS = [
    Variant("dataparallel_sizes_and_replicas_in_sequence", [
        Bug("scatter", "pieces_of_ceil_size",  # nn.DataParallel's own sizes: ceil(B / N), fewer pieces
            patch=[(TENSOR_PIECE, "            return o[i * -(-b // len(used)):(i + 1) * -(-b // len(used))]"
                                  ".to(used[i])\n"),
                   (PIECES, "    return [piece(obj, i) for i in range(len(used) if b is None else "
                            "-(-b // -(-b // len(used))))]\n")],
            loses={"test_scatter_basic": "[2] has shape (3, 2), expected (2, 2)",
                   "test_scatter_structures": "has shape (3, 2), expected (2, 2)"}),
        Bug("mini_data_parallel", "replicas_in_sequence",
            patch=[(THREADS, "        results = [r(*args, **kw) for r, (args, kw) in zip(replicas, pieces)]\n")],
            loses={"test_mini_data_parallel_basic": "the replicas did not run in parallel",
                   "test_mini_data_parallel_edge_cases": "the replicas did not run in parallel"}),
    ]),
    Variant("drops_non_tensors_and_gathers_in_finishing_order", [
        Bug("scatter", "drops_non_tensors",
            patch=[("        return o\n", "        return None\n")],
            loses={"test_scatter_structures": "['scale'] is None, expected 0.5"},
            keeps=["test_scatter_basic"]),
        Bug("mini_data_parallel", "gathers_in_finishing_order",
            patch=[("        results, errors = [None] * len(pieces), [None] * len(pieces)\n",
                    "        results, errors, lock = [], [None] * len(pieces), threading.Lock()\n"),
                   (CALL, "                out = replicas[i](*args, **kw)\n"
                          "                with lock:\n"
                          "                    results.append(out)  # in the order the threads finish\n")],
            loses={"test_mini_data_parallel_edge_cases": "gather the replicas' outputs in device order"}),
    ]),
    Variant("empty_pieces_and_detached_outputs", [
        Bug("scatter", "empty_pieces_for_spare_devices",
            patch=[(USED, "    used = devices\n")],
            loses={"test_scatter_structures": "scatter(2 rows, 4 CPU devices) has 4 elements, expected 2"},
            keeps=["test_scatter_basic"]),
        Bug("mini_data_parallel", "detached_outputs",
            patch=[("o.to(self.output_device) for o in outs", "o.detach().to(self.output_device) for o in outs")],
            loses={"test_mini_data_parallel_basic": "does not require grad",
                   "test_mini_data_parallel_edge_cases": "does not require grad"}),
    ]),
    Variant("dict_not_split_and_tuple_outputs_lost", [
        Bug("scatter", "dict_passed_whole",
            patch=[("            return {k: piece(v, i) for k, v in o.items()}\n", "            return o\n")],
            loses={"test_scatter_structures": "['offset'] has shape (7,), expected (3,)"},
            keeps=["test_scatter_basic"]),
        Bug("mini_data_parallel", "tensor_outputs_only",
            patch=[(GATHER, "        return torch.cat([o.to(self.output_device) for o in results])\n")],
            loses={"test_mini_data_parallel_edge_cases": "returning (scores, (embedding, 'label')) raised"},
            keeps=["test_mini_data_parallel_basic"]),
    ]),
    Variant("tuples_become_lists_and_keywords_dropped", [
        Bug("scatter", "tuples_become_lists",
            patch=[(SEQUENCES, "        if isinstance(o, (tuple, list)):\n"
                               "            return [piece(v, i) for v in o]\n")],
            loses={"test_scatter_structures": "should be a tuple"},
            keeps=["test_scatter_basic"]),
        Bug("mini_data_parallel", "keyword_inputs_dropped",
            patch=[(CALL, "                results[i] = replicas[i](*args)\n")],
            loses={"test_mini_data_parallel_edge_cases": "with keyword inputs scale=0.5"},
            keeps=["test_mini_data_parallel_basic"]),
    ]),
    Variant("labels_not_split_and_grad_mode_not_carried", [
        Bug("scatter", "only_float_tensors_split",
            patch=[(TENSOR_PIECE, "            return torch.tensor_split(o, len(used))[i].to(used[i]) "
                                  "if o.is_floating_point() else o\n")],
            loses={"test_scatter_structures": "['offset'] has shape (7,), expected (3,)"},
            keeps=["test_scatter_basic"]),
        Bug("mini_data_parallel", "grad_mode_not_carried_into_threads",
            patch=[("            torch.set_grad_enabled(grad_enabled)\n", "            pass\n")],
            loses={"test_mini_data_parallel_edge_cases": "under torch.no_grad() the replicas of MiniDataParallel ran"},
            keeps=["test_mini_data_parallel_basic"]),
    ]),
]
