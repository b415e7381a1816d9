"""Context parallelism (``--cp N``): every sequence split over the ``cp`` ranks, attention exact.

Load balance (Megatron's and torchtitan's): the sequence is cut into ``2N`` equal chunks and rank
``i`` of the CP group holds chunks ``i`` and ``2N-1-i``, so under the causal mask every rank has
the same attention work. All ranks of one CP group read the same micro-batch
(:attr:`lpbench.parallel.dims.ParallelDims` gives them one data rank) and keep their chunks
(:meth:`ContextParallel.shard`); everything but attention is per token and runs on the local
chunks unchanged. RoPE and learned positions are those of the tokens' places in the whole
sequence (:meth:`ContextParallel.positions`).

Attention: all-gather of K and V over the CP group, as Llama 3's training did, instead of a ring.
It works on every device and process-group backend (gloo on CPU included) and is exact. The gather
(:meth:`ContextParallel.gather`) is autograd-aware (``all_gather_tensor_autograd``: the gradients of K
and V are reduce-scattered back, summed over the ranks whose queries used them); its cost is the
gathered K/V of one layer at a time, which GQA keeps small. torch's ``context_parallel`` ring attention
is CUDA-only and patches SDPA globally, so it is not used.

* Causal (pretraining): one SDPA call per local query chunk over the gathered keys up to its end, under
  a causal mask aligned at the lower right (``torch.nn.attention.bias.causal_lower_right``), which SDPA
  runs as flash attention's own bottom-right alignment on CUDA (no mask in memory, no masked blocks
  computed). The masks are made once per local length outside the compiled blocks (Dynamo traces SDPA
  given a ``CausalBias``, not the bias's construction), so a compiled block keeps the gather and its
  attention in its one graph. An explicit boolean mask would cost S²/N bytes and rule flash out;
  flex_attention would need compiling even eagerly and trails flash on the dense causal case.
* Packed SFT (document masking): every rank keeps the whole sequences' document ids (``shard`` leaves
  them whole), and its queries attend to the gathered keys of their own document up to their place
  (:func:`lpbench.models.decoder.document_mask` with ``query``: flex's block mask on CUDA, SDPA's bool
  mask elsewhere); positions restart at each document as without CP.

The loss: each rank's cross-entropy sum over its tokens, divided by the whole sequence's label count
(all-reduced over the CP group) and multiplied by ``N``, so that the average over the CP ranks (FSDP's
gradient reduction over ``dp_shard_cp``, the logged loss's over ``loss``) is the mean over the
global tokens. Quantized linears reduce their per-tensor amaxes of activations and gradients (and
NVFP4's global scales) over the CP group (``cp_shard`` on each
:class:`lpbench.precision.linear.QuantizedGemms`), so the local chunks quantize as the whole sequence
would. MoE layers route each rank's own tokens; their load-balancing loss counts the tokens of every
data-parallel and CP rank (``MoE.count_group``: the ``loss`` mesh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from lpbench import gemm
from lpbench.models.decoder import Attention
from lpbench.precision.linear import QuantizedGemms


# torch >= 2.11 names it all_gather_single_autograd (and deprecates the older name)
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class ContextParallel:
    """One CP group's split of the sequence and its attention; the model's ``context_parallel`` attribute."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.local_len = 0  # tokens per sequence on this rank, as the last forward saw them
        self.masks = ()  # per local query chunk: its lower-right causal mask over the keys up to its end

    def chunks(self) -> tuple[int, int]:
        """The indices of this rank's two chunks among the sequence's ``2 × size``."""
        return self.rank, 2 * self.size - 1 - self.rank

    def index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Positions in the whole sequence (``seq_len`` tokens) of this rank's tokens, in local order."""
        chunk = seq_len // (2 * self.size)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.chunks()])

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Positions in the whole sequence of the ``local_len`` tokens this rank holds (the decoder asks at each
        forward; the quantizers' :meth:`token_index` follows that length, attention the masks made here: outside
        any recomputed region, whose dispatch mode cannot create the masks' tensor subclass)."""
        if local_len != self.local_len:
            chunk = local_len // 2
            self.masks = tuple(causal_lower_right(chunk, (c + 1) * chunk) for c in self.chunks())
            self.local_len = local_len
        return self.index(local_len * self.size, device)

    def token_index(self, n_tokens: int, device: torch.device) -> torch.Tensor:
        """Where this rank's ``n_tokens`` flattened tokens ``[B, local_len]`` lie among the whole micro-batch's
        ``[B, local_len × size]`` (a quantizer's stochastic-rounding draws are made for the whole operand)."""
        whole = self.local_len * self.size
        rows = torch.arange(n_tokens // self.local_len, device=device)
        return (rows[:, None] * whole + self.index(whole, device)).flatten()

    def shard(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's chunks (along dim 1) of a micro-batch's ``input_ids`` and ``labels`` [B, S]; a third argument,
        packed SFT's ``doc_ids``, stays whole: every rank's queries need the documents of all the keys."""
        idx = self.index(args[0].shape[1], args[0].device)
        return [t.index_select(1, idx) for t in args[:2]] + list(args[2:])

    def label_count(self, labels: torch.Tensor) -> torch.Tensor:
        """The number of tokens with a label (not -100) in the whole sequences, over the CP group."""
        n = (labels != -100).sum().float()
        return funcol.wait_tensor(funcol.all_reduce(n, "sum", self.group))

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole sequence's keys and values [B, H_kv, S, D] from this rank's [B, H_kv, S_local, D]: one
        all-gather over the group (rank-major, reordered to sequence order) whose backward reduce-scatters the
        gradients back, summed over the ranks whose queries used them."""
        chunk = k.shape[2] // 2
        kv = torch.cat([k, v], dim=1).transpose(0, 2).contiguous()  # [S_local, H_kv k + v, B, D]: gathered on dim 0
        kv = _all_gather(kv, gather_dim=0, group=self.group)
        kv = kv.index_select(0, self._order(chunk, kv.device)).transpose(0, 2)
        return kv.split([k.shape[1], v.shape[1]], dim=1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        """Causal attention of this rank's queries ``q`` [B, H, S_local, D] over the whole sequence's keys ``k``,
        ``v`` [B, H_kv, S, D] (:meth:`gather`): each local query chunk ``c`` attends to the first ``(c + 1)``
        chunks' keys under its lower-right causal mask (on CUDA, flash attention's own bottom-right alignment).
        The masks are made outside the compiled blocks (:meth:`positions`): Dynamo traces SDPA given a
        ``CausalBias`` but not its construction, so a compiled block keeps attention in its one graph."""
        chunk = q.shape[2] // 2
        outs = []
        for n, (c, mask) in enumerate(zip(self.chunks(), self.masks)):
            end = (c + 1) * chunk
            outs.append(
                gemm.attention(
                    q[:, :, n * chunk : (n + 1) * chunk],
                    k[:, :, :end],
                    v[:, :, :end],
                    attn_mask=mask,
                    enable_gqa=enable_gqa,
                )
            )
        return torch.cat(outs, dim=2)

    def _order(self, chunk: int, device: torch.device) -> torch.Tensor:
        """Where each of the sequence's tokens lies in the rank-major gather: rank r holds chunks r and 2N-1-r, so
        chunk j < N is the gather's chunk 2j and chunk j >= N its chunk 2(2N-1-j)+1 (torch ops on ``device``: no
        host copy inside a compiled block)."""
        j = torch.arange(2 * self.size, device=device)
        where = torch.where(j < self.size, 2 * j, 2 * (2 * self.size - 1 - j) + 1)
        return (where[:, None] * chunk + torch.arange(chunk, device=device)).flatten()


def apply_cp(model: nn.Module, group: dist.ProcessGroup, rank: int, size: int) -> ContextParallel:
    """Split ``model``'s sequences over ``group``: the decoder's positions, attention and loss, and the amax
    reductions of its quantized linears."""
    cp = ContextParallel(group, rank, size)
    model.context_parallel = cp
    for module in model.modules():
        if isinstance(module, Attention):
            module.context_parallel = cp
        if isinstance(module, QuantizedGemms):
            module.cp_shard = cp
    return cp
