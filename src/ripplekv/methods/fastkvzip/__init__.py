"""FastKVzip: KVzip's scores predicted by a small gate per layer (`gate`), fitted here, read by its scorer (`method`)."""
