"""CUDA graphs of the fast decoder's decode steps (StaticDecoder.for_model's cuda_graph, on CUDA).

A graph replays one decode step of a batch bucket (the live rows rounded up to a power of two) over a fixed span
of cache slots, without the per-kernel launch cost that dominates decoding small batches. The decoder's weight
copies are refreshed in place at every call (layers/engine.py's `_put`), so the captured graphs stay valid across
optimizer steps and never see an FSDP hook. The step a graph captures is StaticDecoder._decode_body with each row's
slot as a tensor (read on the device at replay) over cache slots [0, span), the key mask saying which are real.

`Graphs` holds the captured graphs, not the decoder: the decoder holds it (`dec.graphs`, None when graphs are off)
and hands itself to each call, so no cycle keeps the decoder's copies and cache alive past the rollout. It holds its
steps' inputs, each row's token and slot (`tok_in`, `slot_in`). Of the project it imports nothing.
"""

import torch


class Graphs:
    """A decoder's CUDA graphs, (batch bucket, cache span) -> (graph, logits output), captured at first use."""

    def __init__(self, dec):
        """The graphs of the decoder dec's steps (none captured yet); it keeps none of dec."""
        self.captured = {}
        # a graph attends over a fixed span of cache slots: spans grow in steps (at most 8 of them), so early
        # tokens do not read the whole cache, at the price of one graph per span
        self.span_step = 64 * -(-dec.max_len // (64 * 8))
        self.tok_in = torch.zeros(dec.max_batch, dtype=torch.long, device=dec.device)  # each row's token
        self.slot_in = torch.zeros(dec.max_batch, dtype=torch.long, device=dec.device)  # each row's cache slot

    def clear(self):
        """Forget the captured graphs: what they captured (the attention, routing records) has changed."""
        self.captured.clear()

    @staticmethod
    def batch_for(dec, n):
        """The decode batch that serves n live rows: the next power of two (at most the decoder's rows)."""
        return min(dec.max_batch, 1 << max(0, n - 1).bit_length())

    def worth_compacting(self, dec, live, current):
        """Compaction copies the cache: on graphs do it when the bucket shrinks."""
        return self.batch_for(dec, live) < self.batch_for(dec, current)

    def decode(self, dec, tok, slot, top):
        """`dec.decode` on CUDA graphs: the step of the batch bucket and cache span that hold these rows, replayed."""
        n = tok.shape[0]
        b = self.batch_for(dec, n)
        self.tok_in[:n] = tok
        self.slot_in[:n] = slot
        self.slot_in[n:b] = 0  # bucket rows past the live ones: stale rows, any slot will do
        span = min(dec.max_len, -(-(top + 1) // self.span_step) * self.span_step)  # slots [0, span) hold top
        if (b, span) not in self.captured:
            self.captured[b, span] = self._capture(dec, b, span)
        graph, out = self.captured[b, span]
        graph.replay()
        return out[:n]

    def body(self, dec, b, span):
        """The decode step a graph of batch bucket b and cache span `span` captures: its tokens in tok_in[:b],
        each row's slot in slot_in[:b], read on the device at replay; a graph's span starts at slot 0."""
        return dec._decode_body(self.tok_in[:b], self.slot_in[:b], span, 0)

    def _capture(self, dec, b, span):
        # warm-up on a side stream, then capture; running the body computes this very step's values, so the
        # cache slots it writes get the same contents the replay writes. Recurrent states are not slots: each
        # run would feed them the token again, so they are put back as they were before the replay runs
        saved = [layer.snapshot() for layer in dec.recurrent.values()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.body(dec, b, span)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.body(dec, b, span)
        for layer, states in zip(dec.recurrent.values(), saved):
            layer.restore(states)
        return graph, out
