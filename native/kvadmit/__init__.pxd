# Makes native/kvadmit a Cython package, so `from kvadmit._allocator cimport ...`
# finds native/kvadmit/_allocator.pxd (setup.py puts native/ on the include path)
# and each module compiles under the name Python imports it by (kvadmit._allocator).
