"""Pure-torch stand-ins for the sgl-kernel ops on sglang's CPU NGRAM speculative path.

Semantics follow the CUDA / CPU kernels of sgl-kernel; all outputs are written in place.
Draft trees are tiny (draft_token_num <= ~16 nodes per request), so plain loops are fine.
"""

import ctypes

import torch


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,  # [bs * D * D] bool; row i, col j: j is i or an ancestor of i
    verified_seq_len: torch.Tensor,  # [bs]
    positions: torch.Tensor,  # [bs * D], out
    retrive_index: torch.Tensor,  # [bs, D], out
    retrive_next_token: torch.Tensor,  # [bs, D], out: first child
    retrive_next_sibling: torch.Tensor,  # [bs, D], out: next child of the same parent
    batch_size: int,
    draft_token_num: int,
) -> None:
    bs, d = batch_size, draft_token_num
    mask = tree_mask.view(bs, d, d).cpu()
    strict = torch.ones(d, d, dtype=torch.bool).tril(-1)  # j < i
    anc = mask & strict  # strict ancestors
    depth = anc.sum(-1)  # [bs, D]
    positions.copy_((depth + verified_seq_len.view(bs, 1).cpu()).flatten())
    retrive_index.copy_(torch.arange(bs * d, dtype=torch.int64).view(bs, d))
    # immediate parent = largest strict ancestor (-1 for the root)
    order = torch.arange(d)
    parent = torch.where(anc.any(-1), (anc * order).argmax(-1), -1)
    next_token = torch.full((bs, d), -1, dtype=torch.int64)
    next_sibling = torch.full((bs, d), -1, dtype=torch.int64)
    for b in range(bs):
        first_child = {}  # scanned from the back, so later nodes are already recorded
        for i, p in reversed(list(enumerate(parent[b].tolist()))):
            next_token[b, i] = first_child.get(i, -1)
            if p >= 0:
                next_sibling[b, i] = first_child.get(p, -1)
                first_child[p] = i
    retrive_next_token.copy_(next_token)
    retrive_next_sibling.copy_(next_sibling)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,  # [bs * D] int32, out
    accept_index: torch.Tensor,  # [bs, S] int32, out (pre-filled with -1)
    accept_token_num: torch.Tensor,  # [bs] int32, out: accepted drafts (excl. bonus)
    candidates: torch.Tensor,  # [bs, D] draft token ids (node 0 = last verified token)
    retrive_index: torch.Tensor,  # [bs, D] flat node index
    retrive_next_token: torch.Tensor,  # [bs, D]
    retrive_next_sibling: torch.Tensor,  # [bs, D]
    target_predict: torch.Tensor,  # [bs, D] target argmax at every node
) -> None:
    bs, d = candidates.shape
    num_spec = accept_index.shape[1]
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    tgt = target_predict.flatten().tolist()
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        n_acc, cur = 0, 0
        for _ in range(1, num_spec):
            cur = nxt[b][cur]
            while cur != -1:
                if cand[b][cur] == tgt[last]:  # draft matches the target's choice: accept
                    predicts[last] = tgt[last]
                    n_acc += 1
                    accept_index[b, n_acc] = ridx[b][cur]
                    last = ridx[b][cur]
                    break
                cur = sib[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = n_acc
        predicts[last] = tgt[last]  # bonus token


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,  # out: req_to_token[r, start:end] of all reqs, packed
    pool_len: int,
) -> None:
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[pos : pos + e - s] = req_to_token[r, s:e]
        pos += e - s


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,  # out: req_to_token[r, start:end] = the next slots of out_cache_loc
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,  # new slots of all reqs, packed
    pool_len: int,
) -> None:
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[pos : pos + e - s].to(req_to_token.dtype)
        pos += e - s


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,  # [bs, S], -1 = not accepted
    out_cache_loc: torch.Tensor,  # cache slots of the verified draft tokens
    accept_out_cache_loc: torch.Tensor,  # out: slots of the accepted ones, packed
) -> None:
    idx = accept_index.flatten()
    idx = idx[idx != -1].long()
    accept_out_cache_loc[: idx.numel()] = out_cache_loc[idx]


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [n_buffers] uint64 addresses of the per-layer K/V buffers
    strides: torch.Tensor,  # [n_buffers] bytes per token slot (row)
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """buffer[tgt_loc] = buffer[src_loc] for every buffer (KV move of accepted draft tokens)."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long().cpu(), src_loc.long().cpu()
    n_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (n_rows * stride)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, stride)
        rows[tgt] = rows[src]  # gather first, then scatter: safe if tgt and src overlap


# ---- EAGLE (--speculative-algorithm EAGLE) ----


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,  # out: [bs * topk * num_steps]
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Draft-decode write slots: row b gets req_to_token[r_b, seq_len_b : seq_len_b + topk * num_steps]."""
    width = topk * num_steps
    for b, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * width : (b + 1) * width] = req_to_token[r, s : s + width]


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,  # [bs * accept_stride] (or [bs, accept_stride])
    accept_lens: torch.Tensor,  # [bs], includes the bonus token
    bonus_tokens: torch.Tensor,  # out: [bs]
    accept_stride: int,
) -> None:
    """bonus_tokens[b] = the last accepted token of request b."""
    bs = accept_lens.shape[0]
    idx = torch.arange(bs, dtype=torch.int64) * accept_stride + accept_lens.long().cpu() - 1
    bonus_tokens.copy_(accept_tokens.flatten()[idx.to(accept_tokens.device)].to(bonus_tokens.dtype))


_QLEN_ONLY, _FULL_MASK = 1, 0


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,  # [bs, W]: tree-buffer index of each draft step's parent
    selected_index: torch.Tensor,  # [bs, D - 1]: tree-buffer index of each chosen draft token
    verified_seq_len: torch.Tensor,  # [bs]
    tree_mask: torch.Tensor,  # out (pre-filled True)
    positions: torch.Tensor,  # out: [bs * D]
    retrive_index: torch.Tensor,  # out: [bs, D] (pre-filled -1)
    retrive_next_token: torch.Tensor,  # out: [bs, D] (pre-filled -1)
    retrive_next_sibling: torch.Tensor,  # out: [bs, D] (pre-filled -1)
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The EAGLE draft tree: node 0 is the bonus token, node i (1..D-1) the draft token chosen
    i-th; its parent is the node whose selected index is parent_list[selected_index[i-1] // topk]
    (the root when that quotient is 0). Writes each node's position (seq_len + depth), first-child
    / next-sibling links (children in increasing node order), and the attention mask row of every
    node (root, itself and its ancestors), in QLEN_ONLY ([bs, D, D]) or FULL_MASK (per request
    [D, seq_len + D] with the prefix columns left as pre-filled) layout."""
    mode = int(tree_mask_mode)
    if mode not in (_QLEN_ONLY, _FULL_MASK):
        raise NotImplementedError(f"tree mask mode {mode} is not supported by the CPU stand-in")
    d = draft_token_num
    bs = verified_seq_len.shape[0]
    sel_all = selected_index.tolist()
    par_all = parent_list.tolist() if parent_list.numel() else [[] for _ in range(bs)]
    seq_lens = verified_seq_len.tolist()
    mask = tree_mask.view(-1)
    pos_out = [0] * (bs * d)
    nxt = [[-1] * d for _ in range(bs)]
    sib = [[-1] * d for _ in range(bs)]
    prefix_sum = 0
    for b in range(bs):
        sel, par, seq_len = sel_all[b], par_all[b], seq_lens[b]

        def parent_node(node_pos: int) -> int:
            """Tree position (0 = root) of the parent of selected entry node_pos (node node_pos + 1);
            -1 when the parent is not among the selected tokens."""
            tb = sel[node_pos] // topk
            if tb == 0:
                return 0
            want = par[tb]
            for pp in range(d - 1):
                if sel[pp] == want:
                    return pp + 1
            return -1

        for i in range(d - 1, 0, -1):
            p = parent_node(i - 1)
            if p >= 0:
                if nxt[b][p] != -1:
                    sib[b][i] = nxt[b][p]
                nxt[b][p] = i
        if mode == _QLEN_ONLY:
            row0, row_stride = d * d * b, d
        else:
            row0, row_stride = d * d * b + prefix_sum * d + seq_len, seq_len + d
        for x in range(d):
            start = row0 + row_stride * x
            mask[start] = True
            mask[start + 1 : start + d] = False
            depth_x, node = 0, x
            while node > 0 and depth_x < depth:
                depth_x += 1
                mask[start + node] = True
                node = parent_node(node - 1)
            pos_out[b * d + x] = seq_len + depth_x
        prefix_sum += seq_len
    positions.copy_(torch.tensor(pos_out, dtype=positions.dtype))
    retrive_index.copy_(torch.arange(bs * d, dtype=torch.int64).view(bs, d))
    retrive_next_token.copy_(torch.tensor(nxt, dtype=torch.int64))
    retrive_next_sibling.copy_(torch.tensor(sib, dtype=torch.int64))
