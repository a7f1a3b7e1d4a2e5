"""Tools of notebook 11 (less communication): gradient compression, local SGD, asynchronous SGD.

  data      gradients whose every sum is exact (so a distributed result can equal a simulation bit for
            bit), and the small regression task every run of the notebook trains on
  costs     bytes: what each method hands to the network per step, by formula and from records
  runs      what a rank does in a test or a demo: your function on a fixed task, plain results back
  checks    the comparisons test cells make, with messages that say which rank, step or tensor is off
  curves    the same task trained every way (yours), loss against bytes, in one picture
  pictures  which coordinates top-k sent, step by step, with and without error feedback
  bench     step time of your PowerSGD hook against torch's powerSGD_hook, same model, same run
"""
