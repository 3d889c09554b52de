"""Evaluation through the split, apart from the algorithms: every method evaluates the same way.

- :class:`~hosfl_dist.evaluation.server.EvalServer` (server side, beside the algorithm's server and served by the
  same endpoint): the evaluation calls (``eval_batch``; for generation tasks ``eval_next_token`` with f_s's KV cache
  and ``eval_generated``) and the statistics a metrics row pops;
- :class:`~hosfl_dist.evaluation.client.Evaluator` (the leader client worker): the held-out batches through an
  up-to-date θc (the algorithm says which: :meth:`WorkerBase.eval_params`) and the server; greedy decoding through
  the split for generation tasks, with a KV cache on each side.

Evaluation traffic is declared ``eval``: it is monitoring, not part of training.
"""
