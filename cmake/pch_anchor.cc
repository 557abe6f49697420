// Anchor translation unit: gives the limbo_pch target something to compile so
// that its precompiled header can be shared with REUSE_FROM.
int limbo_pch_anchor() { return 0; }
