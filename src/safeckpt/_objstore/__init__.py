"""A checkpoint root on an object store, once for every service: the generic object-root store.

An object store has no rename, no directories and no ``fsync``, but it has
whole-object writes that can be conditional on what is there. On those alone
this package builds every guarantee a root needs (see ``docs/format.md``): the
commit object written last with a create-only PUT (``store``), directories
without rename (``aliases``), the lease lock (``lease``) and the check that the
server honours conditional writes at all (``conditions``), uploads and ranged
reads in parts (``transfer``), keys spread over prefixes (``spread``) and DCP's
storage on it, every byte verified (``dcp``).

A service is a *client* (:class:`~.client.ObjectClient`): a few requests and
the errors they raise. ``safeckpt._s3`` is S3's; a new service writes one and
registers its scheme with a factory that builds :class:`~.store.ObjectRootStore`
on it.
"""
