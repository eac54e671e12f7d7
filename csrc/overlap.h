/* overlap.h -- whether arrays share memory: the rules that keep a call from writing what it still reads.
 *
 * Outputs (the forward's out, the backward's dq / dk / dv and its workspace) must not share a byte with an input or
 * with one another, nor have two elements at one address.  Views of one stride pattern (the same strides in every
 * dim either has more than one of; sizes may differ) are compared exactly, so that slices of one packed buffer that
 * interleave without sharing memory (q, k, v, out of a (B, S, 4, H, D) array; with GQA, q's H heads beside k's and
 * v's H_kv in a (B, S, H + 2 H_kv, D) one) are fine; others by the bytes they span (conservative). */
#ifndef FATTN_OVERLAP_H
#define FATTN_OVERLAP_H

#include "dlpack.h"
#include "views.h"

/* 1 if no two elements of the view share memory: each dim's stride steps past all the dims inside it (a view
 * written with a stride of 0, or rows closer than their length, would be written twice at once). */
int fattn_self_disjoint(const bhsd_view *x);
/* 1 if two views share a byte: exact for views of one stride pattern, by their spans otherwise. */
int fattn_overlaps(const bhsd_view *x, const bhsd_view *y);
/* 1 if two views are the same elements (one address, one layout). */
int fattn_same_view(const bhsd_view *x, const bhsd_view *y);
/* 1 if the bytes two arrays of any shape span meet (a workspace, an LSE). */
int fattn_spans_meet(const DLTensor *x, const DLTensor *y);

#endif
